{{/* The release's base name (63 characters at most, as Kubernetes names allow). */}}
{{- define "cacheflow.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cacheflow.operatorName" -}}
{{- printf "%s-operator" (include "cacheflow.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cacheflow.clusterName" -}}
{{- .Values.cluster.name | default .Release.Name -}}
{{- end -}}

{{- define "cacheflow.authSecret" -}}
{{- .Values.auth.secretName | default (printf "%s-auth" (include "cacheflow.fullname" .)) -}}
{{- end -}}

{{- define "cacheflow.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{/* Selector labels: stable for the life of a release. */}}
{{- define "cacheflow.selectorLabels" -}}
app.kubernetes.io/name: cacheflow
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The standard labels of every object the chart renders. */}}
{{- define "cacheflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "cacheflow.selectorLabels" . }}
app.kubernetes.io/version: {{ include "cacheflow.tag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cacheflow
{{- end -}}
